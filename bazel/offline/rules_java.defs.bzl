"""Offline stand-in for @rules_java//java:defs.bzl under Bazel 4 (see README.md): the native rules.

Nothing here is built; @bazel_tools//tools/jdk loads this file while Bazel resolves toolchains.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
