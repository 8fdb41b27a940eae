"""Build hook: compiles the ONNX Runtime custom-op library (plain C, no Python API, no ORT header).

Everything else about the package lives in pyproject.toml. The library is built as
``pakv_onnx/runtime_plugin/libpakv_ort.so`` (a plain shared library that ORT dlopen's), both for
``pip install .`` and editable installs (``pip install -e .`` builds it in place).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

PLUGIN = "pakv_onnx.runtime_plugin.libpakv_ort"
PLUGIN_DIR = os.path.join("pakv_onnx", "runtime_plugin")


class BuildPlugin(build_ext):
    """build_ext that names the plugin ``libpakv_ort.so`` (not a CPython extension module name)."""

    def get_ext_filename(self, ext_name):
        if ext_name.split(".")[-1] == PLUGIN.split(".")[-1]:  # called with the full or the last name
            suffix = ".dylib" if sys.platform == "darwin" else ".so"
            return os.path.join(*ext_name.split(".")[:-1], "libpakv_ort" + suffix)
        return super().get_ext_filename(ext_name)

    def get_export_symbols(self, ext):
        if ext.name == PLUGIN:
            return ["RegisterCustomOps"]
        return super().get_export_symbols(ext)


plugin = Extension(
    PLUGIN,
    sources=[os.path.join(PLUGIN_DIR, "gather_pa_kv_cache.c")],
    depends=[os.path.join(PLUGIN_DIR, "ort_abi.h")],
    extra_compile_args=[
        "-std=c11",
        "-O3",
        "-fvisibility=hidden",
        "-pthread",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
    ],
    extra_link_args=["-pthread"],
    py_limited_api=False,
)

class PlatformWheel(bdist_wheel):
    """Tag the wheel ``py3-none-<platform>``: the plugin is a plain C library with no Python ABI.

    So one wheel serves every supported Python on a platform (as onnxruntime-extensions ships
    its custom-op library); the platform tag stays, since the .so is native code.
    """

    def get_tag(self):
        _python, _abi, platform = super().get_tag()
        return "py3", "none", platform


setup(ext_modules=[plugin], cmdclass={"build_ext": BuildPlugin, "bdist_wheel": PlatformWheel})
