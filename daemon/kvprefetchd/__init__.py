"""kvprefetchd: warms the heads of KV-cache files before the inference engine reads them."""

__version__ = "0.11.0"
