"""Module names of the original checkpoints: the key maps the families state, and the
converters of LoRA files and weights between diffusers' names and the originals'."""
