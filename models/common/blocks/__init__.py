"""The model blocks of the shared decoder: attention (kernels and the tensor-parallel module), rotary
embeddings, the MLP, the mixture-of-experts block, the decoder layer and stack, the Qwen2-VL vision
tower, and LoRA on the parallel layers. They import only the model description (``models/common``'s
config and weight modules) and ``parallel/``; the causal LM (``models/common/causal_lm.py``) puts
them together."""
