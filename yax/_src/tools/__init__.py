"""Tools: thin clients of the rewrite engine (LoRA, quantization, casts,
new params, memory rewrites). A tool never imports another tool.
"""
