"""Hydra glue shared by the jobs: register the schemas, and turn a composed config into dataclasses.

The schemas are frozen dataclasses (composer_rollout.config), which OmegaConf would mark read-only
and Hydra could then not merge group files or overrides into. They are registered as writable
structured nodes instead; the frozen classes come back at the end, from OmegaConf.to_object.
"""

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


def _writable(node: DictConfig) -> DictConfig:
    OmegaConf.set_readonly(node, None)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


def register(name: str, schema: type) -> None:
    """Store `schema` under `name`, for a config file's defaults list (`- name`)."""
    ConfigStore.instance().store(name=name, node=_writable(OmegaConf.structured(schema)))


def to_dataclass(cfg: DictConfig):
    """The composed config as its frozen schema dataclass; the schemas' own checks run here."""
    return OmegaConf.to_object(cfg)
