"""switchhead.serving: `switchhead serve`, Transformers' OpenAI-compatible server on a SwitchHead checkpoint.

    from switchhead.serving import serve; serve("path/or/hub-id", port=8000)

`server` builds and runs the server around Transformers' own (see its docstring for what is ours and why);
`requests` checks a request, `middleware` runs the checks in front of the app, `supervision` holds the state the
parts share and restarts a dead batching worker, `managers` adds cancellation and per-request failures to
Transformers' generation managers. The serving dependencies are imported only when a server starts.
"""

from .middleware import RequestChecks
from .requests import RequestChecker, RequestRefused
from .server import CPU_CACHE_BLOCKS, DEFAULT_CB_BLOCK_SIZE, SERVE_DEFAULTS, SHUTDOWN_DEADLINE, serve, split_model_revision
from .supervision import ServerState

__all__ = ["CPU_CACHE_BLOCKS", "DEFAULT_CB_BLOCK_SIZE", "SERVE_DEFAULTS", "SHUTDOWN_DEADLINE", "RequestChecker", "RequestChecks",
           "RequestRefused", "ServerState", "serve", "split_model_revision"]
