import numpy as np, cupy
from pathlib import Path
from core.models.model import load_model
from core.executor import Plan
from core.testing.tiny_model import make_tiny_model
from providers.cuda.provider import CudaProvider
class Wired(CudaProvider):
    def prepare(self, node): return self._ops.prepare(node)
pool = cupy.get_default_memory_pool()
for dt, q in (("float16", None), ("float16", "int4"), ("float32", None)):
    m = load_model(make_tiny_model(Path(f"/tmp/tm/{dt}{q}"), dtype=dt, quant=q))
    c = m.config; B, S = 3, 5
    ids = np.random.default_rng(0).integers(0, c.vocab_size, (B, S)).astype(np.int64)
    res = []
    for prov in (CudaProvider(), Wired()):
        u = pool.used_bytes()
        plan = Plan(m.graph, m.initializers, prov)
        kv = {n: prov.upload(np.zeros((B, c.num_kv_heads, 16, c.head_size), m.io_dtype)) for n in plan.input_names if n.startswith("past_key_values")}
        f = {"input_ids": prov.upload(ids), "attention_mask": prov.upload(np.ones((B, S), np.int64)), **kv}
        a = prov.download(plan.run(f)["logits"])
        f2 = dict(f, input_ids=prov.upload(ids[:, :1]), attention_mask=prov.upload(np.ones((B, S + 1), np.int64)))
        b = [prov.download(plan.run(f2)["logits"]) for _ in range(3)]
        res.append((a, b, plan.weight_bytes(), len(plan.prepared), plan.host_nodes(), pool.used_bytes() - u))
        del plan, kv, f, f2
    (a0, b0, w0, p0, h0, m0), (a1, b1, w1, p1, h1, m1) = res
    print(dt, q, "prefill eq", np.array_equal(a0, a1), "decode eq", all(np.array_equal(x, y) for x, y in zip(b0, b1)),
          "steady", all(np.array_equal(b1[0], y) for y in b1), "weight_bytes", w0, w1, "prepared", p0, p1,
          "device bytes held", m0, m1, "host nodes", h1, flush=True)
