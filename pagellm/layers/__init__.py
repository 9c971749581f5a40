"""Building blocks of the decoder models, apart from the families (`pagellm/models/`):
linear layers (`linear.py`), vocabulary embedding and LM head (`vocab_embedding.py`),
`RMSNorm` (`layernorm.py`), rotary embedding (`rotary_embedding.py`, its tables in
`rope.py`), gated activations and MLP (`activation.py`, `mlp.py`), the `Attention` layer
(`attention.py`), the mixture-of-experts block (`moe.py`), checkpoint tensors into
parameters (`weights.py`), and a Llama-family stack as one C++ call on the CPU
(`cpu_decoder.py`).

A model built from these shards over tensor-parallel ranks by construction: projections into
heads or MLP columns are column-parallel, projections out of them row-parallel, and the
`Attention` layer gets this rank's heads (`heads_per_rank`). Models are built on the `meta`
device; weights arrive through `load_weights` (`weights.py`), which assigns real tensors in
place of the meta parameters.
"""
