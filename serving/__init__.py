"""switchhead.serving: `switchhead serve`, Transformers' OpenAI-compatible server on a SwitchHead checkpoint.

    from switchhead.serving import serve; serve("path/or/hub-id", port=8000)

`server` holds what is ours around Transformers' server (the model-class lookup, request checks, failure
isolation, cancellation, shutdown; see its docstring). The serving dependencies are imported only when a server
starts.
"""

from .server import (DEFAULT_CB_BLOCK_SIZE, SERVE_DEFAULTS, SHUTDOWN_DEADLINE, RequestChecker, RequestChecks,
                     RequestRefused, ServerState, serve, split_model_revision)

__all__ = ["DEFAULT_CB_BLOCK_SIZE", "SERVE_DEFAULTS", "SHUTDOWN_DEADLINE", "RequestChecker", "RequestChecks",
           "RequestRefused", "ServerState", "serve", "split_model_revision"]
