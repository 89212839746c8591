"""Here, on the CPU (the real compiler, no GPU): the fused kernel's compiled resources over escape pages beside
ZipFusion's (``zipkv.kernels.decode_escape.compile_info``, ``zipkv.kernels.kernel_info.decode_mma_info``; sm_90a,
Llama-3.1-8B's attention shape, the all-compressed path), for the chapter "Beyond the format": where the escape
kernel's time goes. About two minutes.

    TRITON_INTERPRET=0 python .ci/escape_resources.py results/paper/escape_format_resources.csv
"""
import subprocess
import sys
import time

import pandas as pd

from zipkv.kernels import decode_escape, kernel_info

KEYS = ("registers", "spill_stores", "shared_bytes", "ptx_instructions", "shuffles", "ld_global", "barriers")
rows = []
for kernel, info in (("zipfusion", kernel_info.decode_mma_info("compressed", slots=2)),
                     ("escape", decode_escape.compile_info("compressed", slots=2))):
    rows.append(dict(kernel=kernel, **{k: info[k] for k in KEYS}, arch=info["arch"]))
t = pd.DataFrame(rows)
t["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
t["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
print(t.to_string())
t.to_csv(sys.argv[1] if len(sys.argv) > 1 else "escape_format_resources.csv", index=False)
