"""Training a causal LM built from the blocks: ``forward_backward`` over balanced micro-batches (a plain
loop or a ``torch.distributed.pipelining`` schedule), the samples and packing of micro-batches, the
pipeline chunk module, and the forward of a batch split over cp/ulysses ranks. The model is passed in
(duck-typed): nothing here imports the causal LM, which calls into these modules."""
