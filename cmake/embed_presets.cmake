# Turns bench/presets.csv into a header holding it as a string (one source of presets
# for the C++ executables and the Python baseline).
file(READ "${INPUT}" csv)
file(WRITE "${OUTPUT}.tmp" "#pragma once\ninline constexpr const char* kPresetsCsv = R\"mokcsv(${csv})mokcsv\";\n")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
