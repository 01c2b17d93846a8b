// The per-thread PDL launch setting of launch.h.
#include "launch.h"

namespace minillm {
namespace {
thread_local bool g_pdl = false;
}  // namespace

bool pdl_launches() { return g_pdl; }

bool set_pdl_launches(bool on) {
  const bool prev = g_pdl;
  g_pdl = on;
  return prev;
}

}  // namespace minillm
