"""Offline stand-in for @rules_python//python:defs.bzl under Bazel 4 (see README.md)."""

py_binary = native.py_binary
py_library = native.py_library
py_test = native.py_test
