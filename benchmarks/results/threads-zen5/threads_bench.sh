#!/bin/bash
# generate photos sjd-coupled 4 images: quiet / beside a spinning python / beside a 2-thread torch job
L=${LANTERN:-.venv/bin/lantern}  # run from the checkout
run() { rm -rf /tmp/tb; $L generate --model photos --labels 0,1,2,3 --method sjd-coupled --out /tmp/tb --no-progress "$@" 2>&1 | grep -E "wrote|other processes" | sed 's/.*| \([0-9.]* s decoding\).*/\1/'; }
echo "== quiet"; for t in 2 1 auto; do echo "threads $t: $(run --threads $t | tr '\n' ' ')"; done
python3 -c 'while True: pass' & B=$!; sleep 1
echo "== beside a spinning python process"; for t in 2 1 auto; do echo "threads $t: $(run --threads $t | tr '\n' ' ')"; done
kill $B
# a 2-thread torch job: AR decodes in a loop
${PY:-.venv/bin/python} -c "
import torch, lantern
torch.set_num_threads(2)
pipe = lantern.load('photos')
while True: pipe(labels=[0,1,2,3], method='ar', seed=0)
" & T=$!; sleep 8
echo "== beside a 2-thread torch job"; for t in 2 1 auto; do echo "threads $t: $(run --threads $t | tr '\n' ' ')"; done
kill $T; wait 2>/dev/null
