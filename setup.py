import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "requirements.txt"), encoding="utf-8") as f:
    install_requires = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]

# paddlepaddle-gpu satisfies the same import; don't force the CPU wheel onto a GPU host.
if os.environ.get("FD_PADDLE_GPU") == "1":
    install_requires = [r for r in install_requires if not r.startswith("paddlepaddle")]

setup(
    name="fastdeploy-swa",
    version="0.1.0",
    description="FastDeploy-style LLM serving on PaddlePaddle with sliding-window MLA attention for DeepSeek-V3",
    packages=find_packages(include=["fastdeploy", "fastdeploy.*"]),
    python_requires=">=3.10",
    install_requires=install_requires,
    extras_require={
        # torch (CPU) only lets Triton's interpreter run the kernels in tests (docs/design.md §5);
        # transformers: Hugging Face's DeepseekV3, held against the engine in tests.
        "test": ["pytest>=8", "pytest-cov>=5", "diff-cover>=9", "httpx>=0.27", "openai>=1.30", "torch==2.13.0", "ruff", "import-linter>=2.1", "hypothesis>=6.100", "jsonschema>=4.20", "lm_eval[api]>=0.4.13,<0.5", "schemathesis>=4.0", "transformers>=5.0,<6", "mooncake-transfer-engine-non-cuda>=0.3.13", "nixl-cu12>=1.5"],
        # prefill / decode disaggregation's transfer engine (docs/design.md §4.20); its import needs
        # libibverbs1 (Debian's package). GPU hosts: mooncake-transfer-engine (CUDA) instead.
        "kv": ["mooncake-transfer-engine-non-cuda>=0.3.13"],
        # mutation testing (tools/mutation.py, docs/mutation.md); not run in CI
        "mutation": ["mutmut>=3.8,<4"],
    },
)
