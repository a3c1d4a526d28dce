"""Run ann-benchmarks' own ``run.py`` with one fix: its workers' queue race.

    cd /path/to/ann-benchmarks && python /path/to/tqvec/bench/ann_benchmarks/harness_run.py \\
        --local --dataset fashion-mnist-784-euclidean --algorithm tqvec [--batch] [--runs 1]

The harness's worker loop is ``while not queue.empty(): queue.get()``; ``empty()`` of a
multiprocessing queue can be True while the parent's feeder thread is still writing the
definitions to the pipe, so a worker may exit at once and the run ends after "Terminating 1
workers" with nothing run. This wrapper replaces that loop with a ``get`` that waits up to
5 seconds for the next definition (then the queue is drained) and changes nothing else: every
argument goes to the harness's ``main``. The harness itself is not patched on disk.

``--drop-faiss-padding`` (ours, taken out before the harness sees the arguments): the
harness's faiss wrappers return faiss's -1 padding from ``query`` when a probe finds fewer than
k vectors (IVF1204 at nprobe 1 does on full Fashion-MNIST), and the single-query runner then
stops the whole worker at "Implementation returned duplicated candidates". With the flag their
``query`` drops the -1 ids, as tqvec's wrapper does: such a query returns fewer results and
loses recall, as it should.
"""

from __future__ import annotations

import os
import queue
import sys


def drop_faiss_padding() -> None:
    from ann_benchmarks.algorithms.faiss import module as faiss_wrappers

    query = faiss_wrappers.Faiss.query

    def query_without_padding(self, v, n):
        ids = query(self, v, n)
        return ids[ids >= 0]

    faiss_wrappers.Faiss.query = query_without_padding


def main() -> None:
    sys.path.insert(0, os.getcwd())  # the harness checkout
    import ann_benchmarks.main as harness

    if "--drop-faiss-padding" in sys.argv:
        sys.argv.remove("--drop-faiss-padding")
        drop_faiss_padding()

    def run_worker(cpu, mem_limit, args, tasks) -> None:
        while True:
            try:
                definition = tasks.get(timeout=5)
            except queue.Empty:
                return
            if args.local:
                harness.run(definition, args.dataset, args.count, args.runs, args.batch)
            else:
                cpu_limit = str(cpu) if not args.batch else f"0-{os.cpu_count() - 1}"
                harness.run_docker(definition, args.dataset, args.count, args.runs,
                                   args.timeout, args.batch, cpu_limit, mem_limit)

    harness.run_worker = run_worker
    harness.main()


if __name__ == "__main__":
    main()
