"""Test double: libneuronxla.neuron_cc_cache.CacheUrl."""

import os


class CacheUrl:
    def __init__(self, url: str) -> None:
        self.url = url

    def __str__(self) -> str:
        return self.url

    @classmethod
    def get_cache_url(cls, cache_dir=None):
        return cls(cache_dir or os.environ.get("NEURON_COMPILE_CACHE_URL")
                   or "/var/tmp/neuron-compile-cache")
