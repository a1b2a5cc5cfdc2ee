"""The Qwen3-VL vision tower without deepstack, shared by every family whose checkpoint carries
`model.visual.*` (Qwen3.5 dense and MoE, qwen4_exp): its config, the image preprocessing, the
tower itself, and the image prompt layout (placeholder expansion and mRoPE positions).

Nothing here imports a model family; a family's text model only sees the merged features [n, H]
that replace its image-pad embeddings, and 3-row positions.
"""
