"""Checkpoints of a run with Orbax's CheckpointManager: every `save_every` steps, the last `keep` kept.

    directory/
      <step>/state/   the step, the trained arrays (params, or the LoRA adapters over a frozen base) and the
                      optimizer state, written by Orbax (StandardSave)
      <step>/data/    the data iterator's position (JSON), so a resumed run sees the same batches
      <step>/settings/  what that position means something with (JSON): the data file's sha256, how it is cut into
                      batches, the params' dtype (see loop.py's run_settings), checked when a run resumes

Restoring takes its shapes, dtypes and placements from a fresh state, so a checkpoint saved on one mesh
restores onto another (e.g. fsdp=8 onto data=2 × fsdp=4).
"""

from pathlib import Path

import jax

from linnet_jax.train.step import TrainState


def saved_part(state: TrainState) -> dict:
    """What a checkpoint holds of the state: the frozen base params are the model's, not the run's."""
    return {"step": state.step, "trained": state.trained, "opt_state": state.opt_state}


def latest_saved_step(directory: Path) -> int | None:
    """The last step whose checkpoint is in `directory` (None when none is, or there is no such directory),
    read without opening (and so creating) it."""
    import orbax.checkpoint as ocp

    steps = ocp.utils.checkpoint_steps(directory) if directory.is_dir() else []
    return max(steps, default=None)


class Checkpoints:
    """A run's checkpoints. save() after each step (it saves only every `save_every` steps, or when forced);
    restore() returns the state and data position of the latest (or a given) step."""

    def __init__(self, directory, *, save_every: int = 100, keep: int | None = 3):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "settings"))

    def save(self, state: TrainState, data_state: dict, *, settings: dict | None = None, force: bool = False) -> bool:
        """Save at state.step when it is due (or force), with the run's settings when given; returns whether it
        saved."""
        import orbax.checkpoint as ocp

        items = {"state": ocp.args.StandardSave(saved_part(state)), "data": ocp.args.JsonSave(data_state)}
        if settings is not None:
            items["settings"] = ocp.args.JsonSave(settings)
        return self.manager.save(int(state.step), args=ocp.args.Composite(**items), force=force)

    def settings(self, step: int) -> dict | None:
        """The settings saved with a step's checkpoint; None when it has none."""
        import orbax.checkpoint as ocp

        if not (self.directory / str(step) / "settings").is_dir():
            return None
        return dict(self.manager.restore(step, args=ocp.args.Composite(settings=ocp.args.JsonRestore()))["settings"])

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, state: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """`state` (a fresh one, giving shapes, dtypes and placements) with the checkpoint's step, trained arrays and
        optimizer state; and the saved data position. step None: the latest."""
        import orbax.checkpoint as ocp

        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint to resume from")
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                saved_part(state))
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      data=ocp.args.JsonRestore()))
        saved = restored["state"]
        trained = {"lora": saved["trained"]} if state.lora is not None else {"params": saved["trained"]}
        return state.replace(step=saved["step"], opt_state=saved["opt_state"], **trained), dict(restored["data"])

    def close(self) -> None:
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
