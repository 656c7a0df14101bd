"""Inductor's generated kernels for one ``photos`` image (prefill and round graphs), compiled from an
empty cache: ``python benchmarks/results/round-ops-epyc/kcount.py METHOD``."""

import os
import sys
import tempfile

os.environ["LANTERN_COMPILE_CACHE"] = tempfile.mkdtemp()  # before lantern reads it: nothing cached

from torch._inductor import metrics  # noqa: E402

import lantern  # noqa: E402

method = sys.argv[1]
pipe = lantern.load("photos", compile="default")
metrics.reset()
pipe(labels=[1], seed=1, method=method)
print(lantern.__file__, method, "generated kernels:", metrics.generated_kernel_count)
