"""The plugin's kernels, each tested against a plain-torch twin with the same math
(tests/kernels/).

- ``mx_matmul``: the weight-only product on the release's MXFP4/MXFP8 weights, one
  dequantized tile at a time (torch, any device); twin: the whole weight dequantized by
  ``checkpoint/mx_formats.py``, then one matmul.
- ``weight_gemv``: the C kernel (``cpu/weight_gemv.c``, built at first use for this CPU
  by ``cpu_build``) for decode-sized products on MXFP4, MXFP8 and bf16 weights; same twin.
  Its ``routed_experts`` runs a decode batch's routed experts (fp32, bf16 or MXFP4 stacks)
  in one call; twin: the model's grouped experts (``model/deepseek_v41/moe.py``).
- ``sparse_attention``: V4.1's window + top-k sink attention and the lightning
  indexer's scores, each one C call (``cpu/sparse_attention.c``) reading the paged caches
  directly; twins: each query's gathered keys through the attention layer's
  ``sink_attention`` and the indexer's ``index_scores``.
- ``sinkhorn``: the hyper-connections' Sinkhorn loop as one C call (``cpu/sinkhorn.c``),
  opaque to the compiled graph; twin: the same loop in torch.
- ``vllm_kernels``: vLLM's fused V4 CPU kernels (``torch.ops._C``) for the parts they
  compute exactly as the plugin does (the hyper-connection post-mix, the router's top-k),
  where the loaded library has them and the model fits; twins: ``hc_update`` and
  ``route`` of ``model/deepseek_v41/``.
- ``paths``: which kernel, vLLM's fused V4 CPU kernels or the plugin's, computes each part
  of V4.1 on this machine; logged once at start-up.
- Triton kernels for the GPU fast paths (``indexer_scores`` ->
  ``model/deepseek_v41/indexer.py: index_scores``; ``fixed_tile_matmul`` ->
  ``determinism/batch_invariant.py: linear``), tested on the CPU through Triton's
  interpreter and on a GPU compiled. They are imported lazily, only where the tensors
  live on a GPU; nothing is imported at package import time, so importing this package
  never needs Triton or a GPU."""
