// expect: forkpool needs C++20 (-std=c++20)
// standard: c++17
#include <forkpool/forkpool.hpp>

int main() {}
