/* libopapi.so of the opbridge Ascend test double: the older combined operator library name.
 * It holds nothing itself; it is linked with DT_NEEDED on libopapi_math.so and libopapi_nn.so
 * (and, through them, libnnopbase.so), so dlsym on its handle finds every aclnn symbol. */
__attribute__((visibility("default"))) int acldoubleOpapiCombined(void) { return 1; }
