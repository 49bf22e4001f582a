"""Planning tools: fake-tensor memory simulation (simulate), hardware detection (detect), the
memory and step-time model (memory, cost) behind ``tsp plan`` (command)."""
