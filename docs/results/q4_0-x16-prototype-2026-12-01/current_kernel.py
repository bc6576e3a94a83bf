import numpy as np, time, sys
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../packages/cpumoe-formats/tests"))
import cpumoe_formats as cf
from fp4_helpers import prep, views, to_bf16_bits
fmt=sys.argv[1]; H=int(sys.argv[2]); I=int(sys.argv[3]); mode=sys.argv[4]
rng=np.random.default_rng(0)
banks=cf.get_format(fmt).random_banks(1,H,I,rng)
k=cf.Kernel(fmt,1,H,I,mode=None if mode=="native" else mode)
V=views(fmt,banks)
res=[]
for which in ("gate_up","down"):
  for n in (1,8):
    if which=="gate_up":
        xs=to_bf16_bits(rng.standard_normal((n,H))); bufs=[prep(k,x) for x in xs]
        g=cf.aligned_empty((n,I),np.uint16)
        a=(V,0,0,I,[b.ctypes.data for b in bufs],[1.0]*n,[g[j].ctypes.data for j in range(n)]); f=k._k.gate_up
    else:
        gs=to_bf16_bits(rng.standard_normal((n,I))); bufs=[prep(k,x) for x in gs]
        acc=cf.aligned_empty((n,H),np.float32); acc[...]=0
        routes=[(j,0,1.0,bufs[j].ctypes.data) for j in range(n)]
        a=(V,0,H,routes,acc.ctypes.data,H); f=k._k.down
    best=1e9
    for _ in range(60):
        t=time.perf_counter()
        for _ in range(10): f(*a)
        best=min(best,(time.perf_counter()-t)/10)
    res.append(f"{which[:2]}{n}={best*1e6:.0f}")
print(" ".join(res))
