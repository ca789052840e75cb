"""The life of a `nereus run`, one module per part of it.

- `run_setup`: what a run is set up with (`RunSetup`) and the plan changes it makes (`Move`).
- `plans`: the plans a run reads, the ranks they call for, the fused schedule searched once.
- `resolve`: a config or a run folder resolved into a `RunSetup` (`new_run`, `resume_run`).
- `folder`: the run folder made ready for the ranks (written, trimmed, damaged ones set aside).
- `checkpoints`: the checkpoint manager: save, seal, prune, verify and restore.
- `rank_loop`: the loop every rank of a synchronous run runs (`run_rank`), plan changes and
  their verification.
- `async_loop`: an async run's loop: generation and training on their own pools (`run_async`).
- `rank_entry`: what every rank runs (`rank_main`): one loop or the other, by the plan.
- `launch`: the spawn launcher and what a failed run reports.
- `torchrun`: a run that joins a torchrun job, set up without torch.
- `joined_job`: a rank of a torchrun job: agreeing on the setup, failure diagnosis, SIGTERM.
"""
