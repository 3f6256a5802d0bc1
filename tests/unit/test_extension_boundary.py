"""The extension boundary (docs/architecture.md, "Extensions"): the recipe names an optional feature only where it
registers it, and the checkpointer names none (each part saves itself)."""

from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "fsdptrain" / "train"


def test_the_recipe_names_the_drafter_only_in_its_registration():
    lines = [line.strip() for line in (TRAIN / "rl.py").read_text().splitlines() if "drafter" in line.lower()]
    assert lines == ["from fsdptrain.train.drafter_setup import DrafterExtension",
                     "if cfg.drafter.enabled:",
                     "extensions.append(DrafterExtension(cfg, models.policy, mesh=mesh, device=device, "
                     "backend=models.backend,"]


def test_the_checkpointer_and_the_update_name_no_extension():
    for path in (TRAIN.parent / "run" / "checkpointer.py", TRAIN / "step.py", TRAIN / "trained_part.py"):
        assert "drafter" not in path.read_text().lower(), path
