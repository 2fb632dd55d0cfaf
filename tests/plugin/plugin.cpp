// A plugin the tests dlopen() after a pool is made. Built twice, as two builds of "the same"
// library (PLUGIN_VARIANT 1 and 2): different code, so different build ids.

extern "C" int plugin_triple(int x) { return 3 * x + (PLUGIN_VARIANT - 1); }
