"""FastDeploy-style serving of DeepSeek-V3 MLA models with sliding-window attention layers."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy, so ``import fastdeploy`` stays light for tools that need no paddle
    if name == "LLM":
        from fastdeploy.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fastdeploy.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
