"""Model execution: layers, models, kernels, weight loading."""
