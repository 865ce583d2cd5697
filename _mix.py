import time, workbench as wb
from workbench.models import GPTConfig
t=time.time()
cfg = GPTConfig.preset("mixtral-8x7b").replace(n_layers=2, capacity_factor=None, attention="splash", remat="full")
p = wb.plan(cfg, mesh=wb.abstract_mesh("v5p-8", data=-1), rules="fsdp", batch=16, seq=4096, progress=False)
print("SOURCE", p.source, p.source_reason[:1500])
print(p.memory)
print(p.predicted.step_seconds, p.predicted.mfu, p.predicted.implausible)
print(time.time()-t)
