// Source locations for the host executor's reports (scheduler.h): code addresses resolved with
// addr2line from the kernels' debug information, inlined frames included, paths from xla_ffi/.
#include <dlfcn.h>

#include <cstdio>
#include <string>
#include <unordered_map>
#include <vector>

#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {
namespace {

// "jax_hybridep::(anonymous namespace)::SendKernel<false, (jax_hybridep::Dtype)0, false>(...)"
// -> "SendKernel<false, (Dtype)0, false>".
std::string ShortName(std::string name) {
  for (const char* noise :
       {"(anonymous namespace)::", "jax_hybridep::device::", "jax_hybridep::", "host::"}) {
    for (size_t at; (at = name.find(noise)) != std::string::npos;) {
      name.erase(at, std::string(noise).size());
    }
  }
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);
  // Drop the parameter list (the last top-level parenthesis group).
  int depth = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0 && i > 0) return name.substr(0, i);
  }
  return name;
}

// Paths from the repository: xla_ffi/..., or a planted bug's planted/<bug>/<file>.
std::string ShortPath(const std::string& path) {
  for (const char* root : {"xla_ffi/", "planted/"}) {
    const size_t at = path.rfind(root);
    if (at != std::string::npos) return path.substr(at);
  }
  return path;
}

// addr2line's (function, file:line) pairs for an address, innermost inlined frame first.
std::vector<std::pair<std::string, std::string>> Lines(const void* address) {
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return {};
  const auto offset =
      reinterpret_cast<uintptr_t>(address) - reinterpret_cast<uintptr_t>(info.dli_fbase);
  char command[4096];
  std::snprintf(command, sizeof(command), "addr2line -C -f -i -e '%s' 0x%lx 2>/dev/null",
                info.dli_fname, static_cast<unsigned long>(offset));
  FILE* pipe = popen(command, "r");
  if (pipe == nullptr) return {};
  std::vector<std::string> text;
  char line[8192];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    text.push_back(s);
  }
  pclose(pipe);
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t i = 0; i + 1 < text.size(); i += 2) {
    std::string where = text[i + 1];
    const size_t paren = where.find(" (discriminator");
    if (paren != std::string::npos) where.resize(paren);
    out.emplace_back(ShortName(text[i]), ShortPath(where));
  }
  return out;
}

}  // namespace

std::string Symbolize(const void* pc) {
  if (pc == nullptr) return "(unknown location)";
  static std::unordered_map<const void*, std::string> cache;
  auto it = cache.find(pc);
  if (it != cache.end()) return it->second;
  // A return address: the call is the instruction before it.
  // "innermost.cuh:12 <- ... <- kernel.cu:34 (the outermost function)".
  const auto lines = Lines(static_cast<const char*>(pc) - 1);
  std::string s, function;
  for (const auto& [name, where] : lines) {
    if (where.find("??") != std::string::npos) continue;
    s += (s.empty() ? "" : " <- ") + where;
    function = name;
  }
  if (!s.empty()) s += " (" + function + ")";
  if (s.empty()) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%p", pc);
    s = buf;
  }
  return cache[pc] = s;
}

std::string KernelName(const void* kernel) {
  static std::unordered_map<const void*, std::string> cache;
  auto it = cache.find(kernel);
  if (it != cache.end()) return it->second;
  const auto lines = Lines(kernel);
  return cache[kernel] = lines.empty() ? std::string("kernel") : lines.back().first;
}

}  // namespace jax_hybridep::host
