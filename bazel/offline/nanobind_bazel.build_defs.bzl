"""Offline stand-in for @nanobind_bazel//:build_defs.bzl (see README.md).

Upstream nanobind_bazel needs Bazel >= 6.4 (and rules_python, bazel_skylib, platforms). This keeps
the part of its interface BUILD uses: `nanobind_extension(name, srcs, deps, copts, local_defines,
linkopts, domain)` defines `<name>.so` (cc_binary, linkshared) and an alias `<name>`, with nanobind's flags.
"""

load("@rules_cc//cc:defs.bzl", "cc_binary")

NANOBIND_COPTS = ["-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing", "-fno-stack-protector", "-Os"]

def nanobind_extension(name, domain = "", srcs = [], copts = [], deps = [], local_defines = [], linkopts = [], **kwargs):
    cc_binary(
        name = name + ".so",
        srcs = srcs,
        copts = copts + NANOBIND_COPTS,
        deps = deps + ["@nanobind//:nanobind"],
        local_defines = local_defines + (["NB_DOMAIN=" + domain] if domain else []),
        linkopts = linkopts + ["-Wl,--gc-sections"],
        linkshared = True,
        **kwargs
    )
    native.alias(
        name = name,
        actual = name + ".so",
        visibility = kwargs.get("visibility"),
    )
