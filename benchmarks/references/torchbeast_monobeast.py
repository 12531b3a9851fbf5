"""TorchBeast's MonoBeast (facebookresearch/torchbeast, commit 0af07b0), unmodified library code, with each finished
game's return written to TensorBoard as charts/episodic_return against agent steps, so benchmarks/plot.py reads it as
it reads our runs. MonoBeast's own logs.csv keeps one mean per learner batch (a batch where two games end averages
them), so this launcher wraps its `learn` and records, after each batch, every game the batch holds
(`stats["episode_returns"]`, whole games with unclipped rewards), the learner's step count (batches x unroll x batch
size, as MonoBeast counts it), the learning rate and the batch's losses (MonoBeast's names and weights:
losses/pg_loss, losses/baseline_loss = baseline_cost x the summed squared error, losses/entropy_loss = entropy_cost x
the summed negative entropy, losses/total_loss). Everything else is MonoBeast's: its flags, env, model and training.
MonoBeast cannot resume, so a run goes in one stretch. With TorchBeast's own virtual environment (gym 0.19, atari-py
0.2.6), from its checkout (benchmarks/RESULTS.md, Pong beside the references):
  python torchbeast_monobeast.py --env PongNoFrameskip-v4 --num_actors 4 --total_steps 2500000 \
      --savedir runs --xpid monobeast_pong_1
The events go to {savedir}/{xpid}/tensorboard."""

import os
import sys
import threading
import time

from torchbeast import monobeast


class Record:
    """The wrapper of monobeast.learn: called by MonoBeast's learner threads, one batch at a time."""

    def __init__(self, learn):
        self.learn, self.lock, self.writer, self.step, self.start = learn, threading.Lock(), None, 0, time.time()

    def __call__(self, flags, *rest, **kw):
        stats = self.learn(flags, *rest, **kw)
        optimizer = rest[4] if len(rest) > 4 else kw["optimizer"]
        with self.lock:
            if self.writer is None:  # imported here, after MonoBeast forked its actors: tensorboard's imports start
                from torch.utils.tensorboard import SummaryWriter  # threads a fork must not copy

                self.writer = SummaryWriter(os.path.join(flags.savedir, flags.xpid, "tensorboard"))
            self.step += flags.unroll_length * flags.batch_size
            for ret in stats["episode_returns"]:
                self.writer.add_scalar("charts/episodic_return", float(ret), self.step)
            self.writer.add_scalar("charts/SPS", self.step / (time.time() - self.start), self.step)
            self.writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], self.step)
            for name in ("pg_loss", "baseline_loss", "entropy_loss", "total_loss"):
                self.writer.add_scalar(f"losses/{name}", stats[name], self.step)
        return stats

    def close(self):
        if self.writer is not None:
            self.writer.close()


if __name__ == "__main__":
    record = Record(monobeast.learn)
    monobeast.learn = record  # train() looks `learn` up in the module at each call
    flags = monobeast.parser.parse_args(sys.argv[1:])
    try:
        monobeast.main(flags)
    finally:
        record.close()
