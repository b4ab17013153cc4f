"""Offline stand-in for @rules_cuda//cuda:defs.bzl (see README.md).

There is no CUDA toolchain in the offline check: `cuda_library` targets load and can be listed, but
analysing one (building it, or building //:_hybridep with --define=jax_hybridep_cuda=true) fails
with the message below instead of silently producing an empty library.
"""

def _unavailable_impl(ctx):
    fail(("%s: rules_cuda is stubbed out in the offline Bazel check (scripts/bazel_check.sh); " +
          "build the CUDA targets with the real rules_cuda") % ctx.label)

_unavailable = rule(
    implementation = _unavailable_impl,
    attrs = {"srcs": attr.label_list(allow_files = True), "deps": attr.label_list()},
)

def cuda_library(name, srcs = [], hdrs = [], deps = [], **kwargs):
    _unavailable(
        name = name,
        srcs = srcs + hdrs,
        visibility = kwargs.get("visibility"),
        tags = kwargs.get("tags", []),
    )
