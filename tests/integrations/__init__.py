"""Tests of the adapters: Lightning, Accelerate, Transformers, DeepSpeed."""
