"""The evaluation suite: does position-independent reuse keep the model's answers, and
what does a hit save?

  metrics.py     KL, argmax agreement, first divergence, AUC with ties, intervals
  tasks.py       shifted-reuse cases: needle, reordered MuSiQue documents, agent_meta headers
  quality.py     every reuse strategy against full prefill on those cases
  rotation.py    δ-rotation error of k_r, layer 0 (exact) and every layer (with context drift)
  roc.py         position-invariance AUC of c_KV, k_r, V and a GQA model's K, V
  accounting.py  FLOPs and bytes of a forward pass, counted from the config
  cost.py        hit vs miss: FLOPs, bytes, modelled energy; timing.py: CPU wall time
  report.py      tables, JSON and PNGs with the command, seed and model; cli.py: `irminsul eval`
"""
