"""Entry points: the only code that touches Hydra and OmegaConf (and, later, wandb)."""
