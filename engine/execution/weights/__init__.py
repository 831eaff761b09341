"""Weight formats, in one place: where a model's weights come from (checkpoint.py: the default
model, a local directory, a hub id or a .gguf file; safetensors reading), GGUF files read as they
are stored (gguf_file.py) and loaded into a model (gguf_loader.py), GGUF's block formats
(ggml_blocks.py), and the packed forms the C++ kernels read (quantized_weight.py: a file's blocks
in panels; quantized_parts.py: a fused projection's parts of different block types, each in its
own; packed_weight.py: float or int8 panels).

Nothing here imports engine/execution/models/: a model is handed in, and a family says by its
own `_expected_weights` which tensors it needs. A backend's choice of which form each weight
takes stays in that backend (backends/cpu_gguf.py, backends/cpu_linear.py).
"""
