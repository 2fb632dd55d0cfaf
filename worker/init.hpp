#pragma once
// forkpool::init(): the first call in main() of a program that uses StartMethod::spawn, or that
// makes threads before its pools.

namespace forkpool {

// Call first in main(), before the program makes threads or may exit (reading arguments before
// it is fine: that code runs again in every spawned worker).
// - In a spawned worker (a fresh run of the program started by a pool under StartMethod::spawn):
//   serves the pool's tasks and never returns. Code before this call runs again in every
//   spawned worker, as in Python.
// - Elsewhere: starts the program's fork server, from which every later pool under
//   StartMethod::forkserver forks its workers: they inherit no lock held by a thread the program
//   starts afterwards (a fork server forked from a threaded parent would). Returns at once.
// Safe to call more than once (later calls do nothing). Main thread only. Throws
// std::system_error when the fork server cannot be started.
//   int main(int argc, char** argv) {
//     forkpool::init();
//     ...
//   }
void init();

}  // namespace forkpool
