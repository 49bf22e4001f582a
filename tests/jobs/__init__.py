"""Programs the tests start under torchrun, accelerate launch or Lightning's launcher."""
