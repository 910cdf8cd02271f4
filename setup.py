"""Packaging beyond what pyproject.toml says.

* The shipped models (``checkpoints/``, 19 MB) go into the wheel as package data of
  ``jspec.models``, so an installed jspec runs ``python -m jspec demo`` from any directory
  (:mod:`jspec.shipped` finds them there).
* The few-row CPU product (``cpu_kernels/few_row_product/product.cc``, an XLA FFI custom
  call) is compiled against the XLA FFI headers jaxlib ships (``jaxlib/include``;
  jaxlib is a build requirement). It is optional: where it cannot be built (no C++
  compiler), jspec installs without it and uses XLA's products (:mod:`jspec.quant.product`).
"""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Builds the kernel library if it can; a failure leaves jspec on XLA's products."""

    def finalize_options(self):
        super().finalize_options()
        try:
            import os

            import jaxlib                            # its include/ is jax.ffi.include_dir()
            include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
            if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
                raise FileNotFoundError(f"{include}/xla/ffi/api/ffi.h")
        except Exception as e:                       # noqa: BLE001 (any failure: no kernel)
            print(f"jspec: the few-row CPU kernel is not built (no XLA FFI headers: {e})")
            self.extensions = []
            return
        for ext in self.extensions:
            ext.include_dirs.append(include)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:                       # noqa: BLE001
            print(f"jspec: the few-row CPU kernel is not built ({e}); XLA's products are used")

    def get_export_symbols(self, ext):
        # A plain shared library loaded with ctypes, not a Python module: no PyInit_ symbol.
        return []


setup(
    packages=find_packages(include=["jspec", "jspec.*", "pallas_kernels", "pallas_kernels.*",
                                    "cpu_kernels", "cpu_kernels.*"])
    + ["jspec.models"],
    package_dir={"jspec.models": "checkpoints"},
    package_data={"jspec.models": ["**/*"], "cpu_kernels.few_row_product": ["*.cc"]},
    # SmolLM2's drafter in training and its data: kept in the repository so training resumes
    # across sessions (checkpoints/smollm2/README.md), not shipped to users.
    exclude_package_data={"jspec.models": ["smollm2/data/*", "smollm2/drafters/*"]},
    ext_modules=[Extension(
        "cpu_kernels.few_row_product._product",
        sources=["cpu_kernels/few_row_product/product.cc"],
        language="c++",
        # The AVX-512 code is confined to functions with a target attribute and chosen at
        # run time (jspec_rows_supported), so the library loads on any x86-64 CPU.
        extra_compile_args=["-O3", "-std=c++17", "-w", "-g0"],
        optional=True,
    )] if __import__("platform").machine() in ("x86_64", "AMD64") else [],
    cmdclass={"build_ext": OptionalBuildExt},
)
