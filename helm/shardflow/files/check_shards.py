"""`helm test`: every shard of the ring, and every draining shard, has a consumer.

Runs `shardflow shards` in the release's image, with the release's settings, until each such
shard's queue has a consumer or SHARDFLOW_TEST_WAIT_S runs out; prints the shards either way.
"""

import json
import os
import subprocess
import sys
import time

ring = int(os.environ["SHARDFLOW_SHARDS"])
draining = {int(s) for s in os.environ.get("SHARDFLOW_TEST_DRAIN", "").split(",") if s.strip()}
deadline = time.monotonic() + float(os.environ.get("SHARDFLOW_TEST_WAIT_S", "60"))
while True:
    run = subprocess.run(["shardflow", "shards"], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        sys.exit(f"shardflow shards failed ({run.returncode}): {run.stderr.strip()}")
    shards = {line["shard"]: line for line in map(json.loads, run.stdout.splitlines())}
    needed = set(range(ring)) | {
        s for s in draining if shards.get(s, {}).get("state") == "draining"
    }
    missing = sorted(s for s in needed if shards.get(s, {}).get("consumers", 0) < 1)
    if not missing or time.monotonic() > deadline:
        break
    time.sleep(2)
for line in shards.values():
    print(json.dumps(line))
if missing:
    sys.exit(f"no consumer on shards {missing}: are their orchestrators running?")
print(f"every one of the {len(needed)} shards has a consumer")
