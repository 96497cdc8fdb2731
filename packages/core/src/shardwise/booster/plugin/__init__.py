"""`colossalai.booster.plugin`'s path: the data-parallel plugins."""

from shardwise.booster.plugin.dp_plugin_base import DPPluginBase
from shardwise.booster.plugin.gemini_plugin import GeminiPlugin
from shardwise.booster.plugin.low_level_zero_plugin import LowLevelZeroPlugin
from shardwise.booster.plugin.plugin_base import Plugin
from shardwise.booster.plugin.torch_ddp_plugin import TorchDDPPlugin

__all__ = ["DPPluginBase", "GeminiPlugin", "LowLevelZeroPlugin", "Plugin", "TorchDDPPlugin"]
