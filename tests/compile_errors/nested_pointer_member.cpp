// expect: an aggregate with a pointer member cannot cross as its bytes
#include <forkpool/forkpool.hpp>

struct Inner {
  const char* name;
};
struct Outer {
  int id;
  Inner inner[2];
};

int main() {
  forkpool::Writer w;
  w.write(Outer{});
}
