#!/usr/bin/env bash
# DDP over two nodes with torchrun; ckptkit uses the environment torchrun sets.
#
# On two real machines (run on each, NODE_RANK=0 on the one at MASTER_ADDR):
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/two_nodes.sh
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/two_nodes.sh
# With no NODE_RANK, both "nodes" start here on localhost (a rehearsal).
set -euo pipefail
OUT=${OUT:-runs/two-nodes}
PORT=${MASTER_PORT:-29531}
node() {
    python3 -m torch.distributed.run --nnodes 2 --node-rank "$1" --nproc-per-node "${NPROC:-1}" \
        --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "$PORT" \
        -m ckptkit train --mode ddp --epochs "${EPOCHS:-2}" --out "$OUT" --timeout 60 "${@:2}"
}
if [ -n "${NODE_RANK:-}" ]; then
    node "$NODE_RANK" "$@"
else
    node 1 -q "$@" &
    other=$!
    node 0 "$@"
    wait "$other"
fi
