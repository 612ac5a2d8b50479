# Installs the built library into a scratch prefix, then configures, builds and runs
# tests/downstream against it with find_package(mok).
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
function(run_step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}\n${err}")
  endif()
endfunction()
run_step(${CMAKE_COMMAND} --install "${MOK_BINARY_DIR}" --prefix "${prefix}")
run_step(${CMAKE_COMMAND} -S "${DOWNSTREAM_SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
         -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run_step(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run_step("${WORK_DIR}/build/downstream")
