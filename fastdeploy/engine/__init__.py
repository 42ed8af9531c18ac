"""Engine: requests, sampling parameters and the step loop."""
