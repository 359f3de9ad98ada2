"""What tests/test_train_distributed.py runs on each rank of one `torchrun --nproc_per_node 2` launch.

`python -m torch.distributed.run --nproc_per_node 2 tests/distributed_runs.py PLAN.json`: PLAN lists runs
({"name", "recipe", "from", "output", "overrides", "resume", "kill_rank1_after_save"}), trained one after the other
in these two processes (one start-up for all of them). Each rank writes OUTPUT/rank-R.json: the examples it
drew per step (as token-id tuples) and the one-line error a refused run raised. A run with
kill_rank1_after_save ends the launch: rank 1 kills itself with SIGKILL once that checkpoint is written.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def main(plan_path: str) -> None:
    from accelerate import PartialState

    from melt_eval.errors import UserError
    from melt_eval.training import data, runner
    from melt_eval.training.launch import accelerator_kwargs

    rank = PartialState(**accelerator_kwargs()).process_index
    drawn: list = []
    original_next = data.DataStream.next

    def recording_next(self):
        ex = original_next(self)
        drawn.append(ex.input_ids)
        return ex

    data.DataStream.next = recording_next
    original_write = runner.write_checkpoint
    for run in json.loads(Path(plan_path).read_text()):
        drawn.clear()
        kill_after = run.get("kill_rank1_after_save")

        def write_checkpoint(accelerator, output, trainer_state, *args, _kill=kill_after):
            done = original_write(accelerator, output, trainer_state, *args)
            if _kill is not None and trainer_state["step"] == _kill and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # as an OOM killer or a lost node would
            return done

        runner.write_checkpoint = write_checkpoint
        record, start = {"error": None}, time.perf_counter()
        try:
            runner.run_recipe(run["recipe"], run["from"], run["output"], overrides=run["overrides"],
                              resume=run.get("resume", False), progress=False)
        except UserError as exc:
            record["error"] = str(exc)
        record["drawn"], record["seconds"] = list(drawn), time.perf_counter() - start
        Path(run["output"]).mkdir(parents=True, exist_ok=True)
        Path(run["output"], f"rank-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
