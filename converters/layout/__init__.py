"""Layout arithmetic, torch-free: which model a config describes and its units (``model``), where each
layer lives in a Megatron checkpoint (``stages``: pipeline stages, virtual chunks, keys) and how a
Megatron tensor is laid out and split over TP ranks (``megatron``: QKV interleaving, gate/up, vocab
padding). Both conversion paths and every format module read these; nothing here reads files."""
