"""FastDeploy-style serving of DeepSeek-V3 MLA models with sliding-window attention layers."""

__version__ = "0.1.0"
