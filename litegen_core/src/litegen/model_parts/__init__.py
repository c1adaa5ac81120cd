"""Facts about a model's modules and the small surgery built on them: its repeated
blocks, dotted module paths from the config, and the GELU MLPs whose forward can be routed."""
