"""``python -m lantern.cli`` for one rank of a test's torchrun / accelerate launch, which also fails
(exit 70) when native threads of the process group outlive it.

Issue 30: gloo's threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) alive at interpreter exit now and
then abort the rank ("terminate called without an active exception"), rarely enough that a
launch's exit code alone almost always passes. Whether they are alive when ``main`` returns is
certain either way: lantern destroys the group it created, and that frees the threads only when
nothing else holds the group (``lantern.distributed.before_process_group``).
"""

import os
import sys

from lantern.cli.main import main

GLOO_THREADS = ("gloo", "pt_gloo")  # name prefixes (Linux: /proc/self/task/*/comm)


def gloo_threads() -> list[str]:
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):  # not Linux: nothing to read
        return []
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while listed
            continue
    return sorted(n for n in names if n.startswith(GLOO_THREADS))


if __name__ == "__main__":
    code = main()
    left = gloo_threads()
    if left:
        print(f"rank {os.environ.get('RANK')}: the process group's threads outlive lantern's main: {left}",
              file=sys.stderr)
        sys.exit(70)
    sys.exit(code)
